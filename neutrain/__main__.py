"""``python -m neutrain`` and ``accelerate launch -m neutrain`` enter here."""

from neutrain.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
