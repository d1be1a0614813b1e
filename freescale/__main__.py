import sys

from freescale.cli import main

sys.exit(main())
