"""`pdserve serve` settings by concern: each module one mixin of ServeConfig (gateway/config.py) with its
own fields and the checks among them; checks across concerns are ServeConfig's."""
