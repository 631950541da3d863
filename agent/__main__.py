import sys

from agent._entry import main

sys.exit(main())
