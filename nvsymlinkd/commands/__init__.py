"""One module per subcommand; see nvsymlinkd.cli.COMMANDS."""
