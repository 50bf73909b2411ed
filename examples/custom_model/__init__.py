"""An example of a user's own model and data, kept outside the bundle's packages: a job imports them by path.

    python -m jobs.build --client scaffold --server scaffold --name custom_scaffold --output-dir /tmp/jobs \\
        --model custom_model.model:DigitsClassifier --data custom_model.data:DigitsSites --ship examples/custom_model
    nvflare simulator /tmp/jobs/custom_scaffold -w /tmp/ws_custom -n 3

See docs/own_model.md.
"""
