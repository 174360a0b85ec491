from taskloom.cli import main

main()
