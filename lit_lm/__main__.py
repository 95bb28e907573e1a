"""The `lit-lm` command and `python -m lit_lm`: huge pages asked for before anything allocates (torch's CPU allocator
reads the choice at its first allocation, which `import lightning` makes;
lit_lm/strategies/host_malloc.py), then the CLI."""

from typing import Optional

from lit_lm.strategies.host_malloc import ask_huge_pages


def main(args: Optional[list[str]] = None) -> None:
    ask_huge_pages()
    from lit_lm.cli import main as cli

    cli(args)


if __name__ == "__main__":
    main()
