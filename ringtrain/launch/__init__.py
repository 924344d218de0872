"""Launching a job and keeping it honest: `ringtrain run`, rendezvous, failure report, watchdog.

Read in this order:
- `launcher.py`: `ringtrain run`, torchrun's flags on torch's elastic agent.
- `run_args.py`: its command line: torchrun's parser, ringtrain's defaults (said in --help)
  and flags.
- `agent_patches.py`: what the launcher changes in torch's agent, for one launch: tolerated
  ranks, restarts counted for the job across nodes.
- `rendezvous.py`: a free port on one node, reachable addresses across nodes.
- `network.py`: this machine's interfaces, its address on the route to a host, a free port.
- `process_group.py`: `init_distributed` / `destroy_distributed`, a worker's side of the rendezvous.
- `environments.py`: which launcher started this process (torchrun, Slurm, Kubernetes, Ray
  Train, TorchX, MPI) and what it says, as pure functions of the environment.
- `failure_report.py`: one readable block when a worker fails, instead of torch's dump.
- `watchdog.py`: every rank's heartbeat; a rank that dies or hangs stops the others, named.
- `verdicts.py`: what a watchdog does once it finds a failure (the watchdog's base class): fire
  once, share the verdict so every rank names the same peer, let a tolerated peer go.
- `peer_failure.py`: what a watchdog found, and the default reaction (one line, exit 75).
- `hang.py`: which rank never entered the collective the others wait in.
- `cgroup.py`, `memory_exec.py`: `--memory-limit`, a memory cgroup per worker, joined before
  Python starts; which workers the OOM killer ended, and the limit, in the report.
- `live_agent.py`, `live_store.py`: `--live`: the agent replaces a lost worker in place; its
  line to the job's store (lost members, across nodes the store's silence and the agents' exit
  barrier).
- `starts.py`, `zygote.py`, `zygote_server.py`: how the agent starts a worker: a fork of a warm
  process that imported torch once for the job (a restart, a replacement too).
- `live_spares.py`: a live job's warm spares.
- `ending.py`: how a worker process ends (its exit code as the interpreter would give it, then
  no interpreter shutdown): `python -m ringtrain`'s workers and the warm process's forks.

May import: torch, `ringtrain.runtime`, `ringtrain.torch_internals`, `ringtrain.errors`,
`ringtrain.store_keys`, `ringtrain.config` (an unknown flag's hint). Never the trainer, a
strategy or the snapshot code: the launcher runs any script.
"""
