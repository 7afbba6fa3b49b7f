from dallal.cli.main import main

main()
