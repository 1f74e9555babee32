import sys

from fasttrain.cli import main

sys.exit(main())
