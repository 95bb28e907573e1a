from lit_lm.cli import main

main()
