"""The command-line options are generated from the config classes: one option per `opt(...)` field, its help the
field's docstring, its default the field's; the same tree as a config file."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from cocosync.shadowsync.cli.options import OPTIONS, SECTIONS, job_from_options
from cocosync.shadowsync.cli.rank import main as rank_main
from cocosync.shadowsync.cli.train import train
from cocosync.shadowsync.config import ClusterConfig, config_from_dict


def test_every_option_has_help_a_section_and_a_unique_flag():
    flags = [o.spec.flag for o in OPTIONS]
    assert len(flags) == len(set(flags)), flags
    for o in OPTIONS:
        assert o.help and o.spec.section in SECTIONS, o.path
    assert {"--sync", "--trainers", "--embedding-dim", "--table-size", "--hot-rows", "--stop-after"} <= set(flags)


@pytest.mark.parametrize("command", [train, rank_main])
def test_both_commands_take_every_option_and_list_it_under_its_section(command):
    names = {opt for p in command.params if isinstance(p, click.Option) for opt in p.opts}
    assert {o.spec.flag for o in OPTIONS} <= names
    out = CliRunner().invoke(command, ["--help"], terminal_width=200).output
    for section in SECTIONS:
        assert f"{section} options:" in out
    sync = out[out.index("Sync options:"):out.index("Cluster options:")]
    assert "--block-momentum" in sync and "--hot-rows" not in sync
    assert "[default: (runs/latest)]" in out  # TrainConfig.out_dir's default, written once


def test_options_set_the_config_tree_as_a_config_file_does():
    params = {"trainers": 4, "sync__algorithm": "shadow-ma", "model__embedding_dim": 8,
              "model__bottom_mlp": [32, 8], "data_options__table_size": 500, "cluster__exchange_interval": 20.0,
              "cluster__hot_rows": 0}
    cfg, cluster = job_from_options(None, None, params)
    same = config_from_dict({"trainers": 4, "sync": {"algorithm": "shadow-ma"},
                             "model": {"embedding_dim": 8, "bottom_mlp": [32, 8]},
                             "data_options": {"table_size": 500}})
    assert cfg == same
    assert cluster == ClusterConfig(exchange_interval=0.020, hot_rows=0)  # typed in ms, held in seconds


def test_a_bad_value_names_the_option_and_what_is_allowed():
    out = CliRunner().invoke(train, ["--exchange-interval", "5000"])
    assert out.exit_code == 2 and "--exchange-interval 5000 ms is invalid" in out.output
    out = CliRunner().invoke(train, ["--bottom-mlp", "64,x"])
    assert out.exit_code == 2 and "comma-separated layer widths" in out.output


def test_the_node_exchange_is_refused_by_name_where_stores_may_be_reordered(monkeypatch):
    import platform

    from cocosync.shadowsync.config import ConfigError

    assert ClusterConfig(lookup_transport="node-exchange").lookup_transport == "node-exchange"
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(ConfigError, match="'aarch64': use 'exchange'"):
        ClusterConfig(lookup_transport="node-exchange")
    assert ClusterConfig(lookup_transport="exchange").lookup_transport == "exchange"


def test_a_config_files_cluster_table_sets_the_clusterconfig_and_the_command_line_wins(tmp_path):
    from cocosync.shadowsync.config import ConfigError

    path = tmp_path / "run.toml"
    path.write_text('trainers = 3\n[sync]\nalgorithm = "fr-ma"\n[cluster]\nhot_rows = 0\nexchange_interval = 0.01\n')
    cfg, cluster = job_from_options(str(path), None, {"cluster__exchange_interval": 25.0})
    assert (cfg.trainers, cfg.sync.algorithm) == (3, "fr-ma")
    assert cluster == ClusterConfig(hot_rows=0, exchange_interval=0.025)  # the option (ms) over the file (s)
    path.write_text("[cluster]\nhot_row = 0\n")
    with pytest.raises(ConfigError, match=r"unknown \[cluster\] key\(s\) \['hot_row'\]"):
        job_from_options(str(path), None, {})
