import os
import sys

# model.py (presets) lives in the repository root, beside this package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memory_audit.cli import main  # noqa: E402

sys.exit(main())
