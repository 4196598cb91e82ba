import sys

from fusedalign.cli import main

sys.exit(main())
