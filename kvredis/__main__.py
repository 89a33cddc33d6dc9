"""``python -m kvredis``: the ``kvredis`` command line."""

from kvredis.cli.app import main

if __name__ == "__main__":
    main()
