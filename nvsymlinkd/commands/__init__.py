"""One module per subcommand (see nvsymlinkd.cli.COMMANDS), and what they share: usage (summaries, help
format, usage error, --root hints) and output (stdout, the JSON schema version)."""
