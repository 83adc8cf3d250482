"""The ShadowSync job: who does what (`roles`: torchrun's ranks -> embedding servers, sync servers, trainers), one
rank's part from set-up to its summary (`rank`), the trainer with its Hogwild workers and sync (`trainer`), the eval
curve and its best model (`eval_curve`), and on one machine `cocosync train`'s launcher: torch's elastic agent on a
loopback rendezvous (`launch`) and the monitor that watches the ranks through the job's store (`monitor`, `link`)."""
