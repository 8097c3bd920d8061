import sys

from elastic.cli import main

sys.exit(main())
