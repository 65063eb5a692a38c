# Bumblebee and the `tokenizers` package cannot be dependencies of this
# repository. Where they are not installed, the tests use stand-ins with
# their module names and the parts of their public API the library relies
# on: Bumblebee's tokenizer struct (Bumblebee.load_tokenizer/1 returns a
# %Bumblebee.Text.PreTrainedTokenizer{} whose :native_tokenizer is a
# %Tokenizers.Tokenizer{}) and Tokenizers.Tokenizer.save/3, which writes
# tokenizer.json. They are compiled in the test environment only.
unless Code.ensure_loaded?(Tokenizers.Tokenizer) do
  defmodule Tokenizers.Tokenizer do
    @moduledoc false
    # Stand-in: the struct and save/3 of the `tokenizers` package.
    defstruct [:resource]

    def save(%__MODULE__{resource: {:stand_in, source}}, path, _opts \\ []) do
      File.cp!(source, path)
      {:ok, path}
    end
  end
end

unless Code.ensure_loaded?(Bumblebee.Text.PreTrainedTokenizer) do
  defmodule Bumblebee.Text.PreTrainedTokenizer do
    @moduledoc false
    # Stand-in: the struct Bumblebee.load_tokenizer/1 returns.
    defstruct [:native_tokenizer, :type, special_tokens: %{}]
  end
end

defmodule EMLXAxon.TestForeignTokenizers do
  @moduledoc false
  # Tokenizers from the `tokenizers` package and Bumblebee, or the stand-ins
  # below where the packages are not installed.

  @real? Code.ensure_loaded?(Tokenizers.Tokenizer) and
           function_exported?(Tokenizers.Tokenizer, :from_file, 2)

  def native(file) do
    if @real? do
      {:ok, tokenizer} = apply(Tokenizers.Tokenizer, :from_file, [file, []])
      tokenizer
    else
      struct(Tokenizers.Tokenizer, resource: {:stand_in, file})
    end
  end

  def bumblebee(native) do
    struct(Bumblebee.Text.PreTrainedTokenizer, native_tokenizer: native, type: :qwen2)
  end
end
