"""What the comparison expects beyond "torch's DDP passes, so ringtrain's must".

- `EXPECTED_FAILURES`: tests torch's DDP passes that ringtrain's need not pass, each with its
  reason: a test of torch's private internals (nothing a user's code reaches), or a deliberate
  difference. docs/ddp_compat.md has the same table; tests/test_torch_ddp_suite.py keeps the two
  in step. A test that passes with torch but not with ringtrain and is not here fails
  `test_whole_comparison`.
- `NOT_RUN`: tests `--all` leaves out unless `--include-slow`, with the reason.
"""

_LOGGING = ("`_get_ddp_logging_data()` fields of torch's C++ DDP logger ({fields}): torch's "
            "internal telemetry, not behaviour")

EXPECTED_FAILURES: dict[str, str] = {
    "test_ddp_logging_data_cpu": _LOGGING.format(
        fields="timing statistics, which need timestamps at the start of forward, at the first "
        "bucket's launch, at the last gradient and at the end of backward; the rebuilt buckets' "
        "details; `gloo_num_threads`"),
}

NOT_RUN: dict[str, str] = {
    "test_ddp_uneven_inputs": "over 400 s per class here (torch's own timeout for it, on GPUs): "
    "large conv models for many iterations on a 2-core CPU; the join tests "
    "(test_ddp_uneven_input_*, test_ddp_join_model_equivalence, test_ddp_grad_div_uneven_inputs) "
    "cover join() in seconds",
}
