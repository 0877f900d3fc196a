from nvsymlinkd.cli import main

raise SystemExit(main())
