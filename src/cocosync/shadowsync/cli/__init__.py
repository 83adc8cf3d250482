"""ShadowSync's commands: `cocosync train` and `cocosync eval` (`train`), `cocosync data` (`data`)."""
