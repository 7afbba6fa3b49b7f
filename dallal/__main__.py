from dallal.cli import main

main()
