import sys

from ninfer.cli.main import main

sys.exit(main())
