"""`ringtrain run`'s command line: torchrun's own parser, with ringtrain's defaults and flags.

    ringtrain run --help
    parsed = get_args_parser().parse_args(["--nproc-per-node", "2", "train.py"])

Every torchrun flag is torch's (`torch.distributed.run.get_args_parser`, both spellings); this
sets the defaults that differ (a 0.1 s monitor interval, SIGUSR1 passed on, no fixed master
port on one node) and says them in --help, and adds `--watchdog-timeout` and `--cold-starts`.
The launch itself: `ringtrain.launch.launcher`.
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed.run import get_args_parser as _torch_args_parser

from ringtrain.config.suggest import suggest_flags

# The signals the agent passes on to its workers: torch's four, and Slurm's warning signal.
HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")
# A rank may work alone (save, evaluate) while the others wait this long before it is named.
DEFAULT_WATCHDOG_TIMEOUT_S = 60.0
_OUR_DEFAULTS = {
    "--signals-to-handle": "comma-separated signals the agent handles and passes on to the "
                           f"workers (default: {','.join(HANDLED_SIGNALS)}: torch's four and "
                           "Slurm's warning signal)",
    "--master-port": "port of the rendezvous store on the master node (static rendezvous) "
                     "(default: on a single node without --rdzv-endpoint, a free port picked "
                     "by the OS; else 29500)",
    "--monitor-interval": "seconds between checks of the workers' state (default: 0.1, so a "
                          "dead worker is noticed at once)",
}


def get_args_parser():
    """torchrun's argument parser (every flag, `-` and `_` spellings), named `ringtrain run`."""
    parser = _torch_args_parser()
    parser.prog = "ringtrain run"
    parser.set_defaults(monitor_interval=0.1,  # notice a dead worker fast (older torch: 5 s)
                        signals_to_handle=",".join(HANDLED_SIGNALS),
                        # None: "not given", as torch 2.13 says; 2.11 says 29500, which would
                        # turn off the free port of a single-node run (rendezvous.py)
                        master_port=None)
    # torch's help states torch's defaults; say ours where they differ.
    for option, text in _OUR_DEFAULTS.items():
        action = parser._option_string_actions.get(option)  # argparse's table
        if action is not None:
            action.help = text
    parser.add_argument(
        "--watchdog-timeout", "--watchdog_timeout", type=float, default=DEFAULT_WATCHDOG_TIMEOUT_S,
        help="(ringtrain) seconds after which a rank that died, froze, or never entered a "
             "collective the others wait in is named and every rank stopped; the script must "
             "start its group with ringtrain.init_distributed(); 0 turns it off "
             f"(default: {DEFAULT_WATCHDOG_TIMEOUT_S:g})")
    parser.add_argument(
        "--cold-starts", "--cold_starts", action="store_true",
        help="(ringtrain) start `ringtrain train`'s workers, and a live job's replacements, as "
             "fresh interpreters, as torchrun does (~6 s of a core importing torch each), not "
             "forked from a warm process that imported it once for the job (a user's script in "
             "any other job always starts fresh)")
    parser.description = (
        "Launch a script on N processes per node with torch's elastic agent (torchrun's flags). "
        "On a single node a free port is picked automatically. When a worker fails, all "
        "workers stop and the failing rank is reported once. SIGTERM and SIGUSR1 are passed on: "
        "workers get --shutdown-timeout s (default 30) to save, then exit code 143 (requeue me)."
    )
    if not has_shutdown_timeout():  # torch < 2.13: one clear error instead of argparse's
        parser.add_argument("--shutdown-timeout", "--shutdown_timeout", type=_no_shutdown_timeout,
                            help="(needs torch 2.13 or newer)")
    return suggest_flags(parser, otherwise="a flag of your script goes after the script's name "
                         "(ringtrain run [flags of run] SCRIPT [flags of SCRIPT])")


def has_shutdown_timeout() -> bool:
    """Whether this torch's torchrun takes --shutdown-timeout (it came in torch 2.13)."""
    return "--shutdown-timeout" in _torch_args_parser()._option_string_actions  # argparse's table


def _no_shutdown_timeout(text: str) -> int:
    raise argparse.ArgumentTypeError(
        f"needs torch 2.13 or newer: torch {torch.__version__}'s agent gives the workers a fixed "
        "30 s to exit after SIGTERM; drop --shutdown-timeout or upgrade torch")
