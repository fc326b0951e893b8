from consumer_idem.cli import main

main()
