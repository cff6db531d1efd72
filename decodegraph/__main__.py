import sys

from decodegraph.entrypoints.cli import main

sys.exit(main())
