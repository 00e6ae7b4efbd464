from torch_autopar.cli import main

raise SystemExit(main())
