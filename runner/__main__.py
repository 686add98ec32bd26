import sys

from runner.app.cli import main

sys.exit(main())
