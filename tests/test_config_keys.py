"""The key check reads LightningCLI's list-append syntax as jsonargparse does."""

from lit_lm.config_keys import unknown_keys


def test_an_appended_callbacks_init_args_is_not_an_unknown_key():
    """`--trainer.callbacks+.init_args.max_norm 1.0` sets the last appended callback's argument (jsonargparse's
    syntax): `callbacks+` is the key `callbacks`, at any depth of the option, not only at its end."""
    argv = ["--trainer.callbacks+=lit_lm.callbacks.clip.GlobalNormClip", "--trainer.callbacks+.init_args.max_norm",
            "1.0"]
    assert unknown_keys([], argv) == []
    (line,) = unknown_keys([], ["--trainer.callbackz+.init_args.max_norm", "1.0"])
    assert "unknown key 'callbackz'" in line and "did you mean --trainer.callbacks?" in line
