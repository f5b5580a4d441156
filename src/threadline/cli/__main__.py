"""``python -m threadline.cli``: the same command as the ``threadline`` console script."""

from . import main

if __name__ == "__main__":
    main()
