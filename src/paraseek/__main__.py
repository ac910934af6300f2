from paraseek.cli import main

raise SystemExit(main())
