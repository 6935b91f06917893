"""`python -m oscar_cli ...`: the entry torchrun starts (`torchrun --nproc-per-node N -m oscar_cli calibrate ...`)."""

from oscar_cli.app import main

if __name__ == "__main__":
    main()
