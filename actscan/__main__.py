from actscan.cli import main

main()
