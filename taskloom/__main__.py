try:
    from taskloom.cli import main
except KeyboardInterrupt:  # Ctrl-C while still importing: nothing started yet, nothing to clean up
    raise SystemExit(130) from None

main()
