from batchery.cli import main

main()
