"""What the comparison expects beyond "torch's DDP passes, so ringtrain's must".

- `EXPECTED_FAILURES`: tests torch's DDP passes that ringtrain's need not pass, each with its
  reason: a test of torch's private internals (nothing a user's code reaches), or a deliberate
  difference. docs/ddp_compat.md has the same table; tests/test_torch_ddp_suite.py keeps the two
  in step. A test that passes with torch but not with ringtrain and is not here fails
  `test_whole_comparison`.
- `NOT_RUN`: tests `--all` leaves out unless `--include-slow`, with the reason.
"""

_BUFFER_HOOK = ("`_register_buffer_comm_hook`: torch's private, experimental hook for how "
                "buffers are synchronised; ringtrain syncs buffers the public way "
                "(`broadcast_buffers`)")
_LOGGING = ("`_get_ddp_logging_data()` fields of torch's C++ DDP logger ({fields}): torch's "
            "internal telemetry, not behaviour")
_REDUCER = "`{member}` of torch's C++ `Reducer`: ringtrain's reducer is a different object"

EXPECTED_FAILURES: dict[str, str] = {
    "test_ddp_broadcast_buffer_via_hook": _BUFFER_HOOK,
    "test_ddp_buffer_hook_allreduce": _BUFFER_HOOK,
    "test_ddp_buffer_hook_allreduce_return_future": _BUFFER_HOOK,
    "test_ddp_build_debug_param_to_name_mapping":
        "`_build_params_for_reducer` / `_build_debug_param_to_name_mapping`: steps of torch's "
        "reducer construction",
    "test_ddp_build_debug_param_to_name_mapping_requires_grad":
        "`_build_params_for_reducer` / `_build_debug_param_to_name_mapping`: steps of torch's "
        "reducer construction",
    "test_ddp_logging_data_cpu": _LOGGING.format(
        fields="`_set_ddp_runtime_logging_sample_rate`, bucket and timing statistics"),
    "test_different_graph_across_ranks": _LOGGING.format(fields="`has_rebuilt_buckets`"),
    "test_ddp_control_flow_same_across_ranks": _REDUCER.format(member="_get_local_used_map()"),
    "test_ddp_control_flow_different_across_ranks": _REDUCER.format(
        member="_get_local_used_map()"),
    "test_detect_ddp_is_actually_static": _REDUCER.format(member="_ddp_graph_static()"),
    "test_ddp_sink_noclone":
        "`_set_ddp_sink_clone(False)`: a switch inside torch's `_DDPSink` autograd function",
}

NOT_RUN: dict[str, str] = {
    "test_ddp_uneven_inputs": "over 400 s per class here (torch's own timeout for it, on GPUs): "
    "large conv models for many iterations on a 2-core CPU; the join tests "
    "(test_ddp_uneven_input_*, test_ddp_join_model_equivalence, test_ddp_grad_div_uneven_inputs) "
    "cover join() in seconds",
}
