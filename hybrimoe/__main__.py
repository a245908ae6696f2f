import sys

from hybrimoe.commands import main

sys.exit(main())
