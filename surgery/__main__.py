import sys

from surgery.app.cli import main

sys.exit(main())
