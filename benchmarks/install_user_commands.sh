# Sourced by the device scripts (run from the repository root): what `pip install` gives a user and the
# device copy lacks, the recipe codec (`accelerate launch recipe.yaml`) and the `neutrain` command.
cp neutrain-recipe.pth "$(python3 -c 'import site; print(site.getsitepackages()[0])')/"
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m neutrain "$@"\n' > /tmp/bin/neutrain && chmod +x /tmp/bin/neutrain
export PATH=/tmp/bin:$PATH
