"""`python -m repro.reproduce_gpu`: the command stays where people know it; the tool lives in
repro.reproduction.reproduce_gpu."""
if __name__ == "__main__":
    import sys

    from repro.reproduction.reproduce_gpu import main

    sys.exit(main())
