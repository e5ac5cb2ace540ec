from batchery.cli import main

if __name__ == "__main__":  # imported (by API doc tools), it runs nothing
    main()
