from asyncrl.cli import main

main()
