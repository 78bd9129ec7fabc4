"""One module per `nest-megatron` sub-command, each with `add_arguments(parser)` and `run(args) -> int`."""
