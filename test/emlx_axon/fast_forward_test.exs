defmodule EMLXAxon.FastForwardTest do
  use ExUnit.Case, async: true

  alias EMLXAxon.{TestFixtures, TextGeneration}
  alias EMLXAxon.Qwen3.Generate

  @moduletag :fixtures

  setup_all do
    name = "qwen3-4bit-g64"
    %{tokenizer: TestFixtures.tokenizer(name), state: TestFixtures.model(name)}
  end

  test "the tokens a grammar forces are counted in each output's metadata", ctx do
    regex = "Order number: [0-9]{3}, status: (open|closed)"

    %{results: [%{text: text}], metadata: metadata} =
      TextGeneration.run(ctx.tokenizer, ctx.state, "Describe the order:", regex: regex)

    assert text =~ ~r/\AOrder number: [0-9]{3}, status: (open|closed)\z/
    assert metadata.forced_tokens > 0
    assert metadata.forced_tokens < metadata.generated_tokens

    %{metadata: free} =
      TextGeneration.run(ctx.tokenizer, ctx.state, "Describe the order:", max_new_tokens: 8)

    assert free.forced_tokens == 0

    {:ok, %{timings: timings}} =
      Generate.generate(ctx.state, [1, 2, 3], tokenizer: ctx.tokenizer, regex: regex)

    assert timings.forced_tokens > 0
  end
end
