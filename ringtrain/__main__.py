import sys

from ringtrain.cli import main

sys.exit(main())
