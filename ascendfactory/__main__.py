from ascendfactory.cli import main

main()
