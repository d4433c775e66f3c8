"""Phase-by-phase ablations of the bundled engine: a recipe's phases run on the same workload, as a waterfall.

    from infertrace.ablate.recipe import load_recipe
    recipe = load_recipe("recipes/decode_path.yaml").with_changes(preset="tiny", quick=True)
"""
