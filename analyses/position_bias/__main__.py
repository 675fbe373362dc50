"""``python -m analyses.position_bias``: :func:`analyses.position_bias.cli.main`."""

from .cli import main

if __name__ == "__main__":
    main()
