"""``python -m analyses.position_bias``: :func:`analyses.position_bias.cli.main`."""

from analyses.position_bias.cli import main

if __name__ == "__main__":
    main()
