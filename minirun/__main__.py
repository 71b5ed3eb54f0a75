"""`python -m minirun ...`: the CLI without installing the package (e.g. PYTHONPATH=. on a lent GPU)."""
from .cli.main import main

if __name__ == "__main__":
    main()
