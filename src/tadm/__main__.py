from tadm.cli import main

raise SystemExit(main())
