"""`python -m repro.report`: the command stays where people know it; the report lives in
repro.reproduction.report."""
if __name__ == "__main__":
    import sys

    from repro.reproduction.report import main

    sys.exit(main())
