from kvhandoff.cli import main

raise SystemExit(main())
