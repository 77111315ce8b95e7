import sys

from qnpipe.cli import main

sys.exit(main())
