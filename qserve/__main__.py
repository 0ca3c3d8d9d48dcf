from qserve.cli import main; main()  # noqa: E702
