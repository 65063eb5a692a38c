defmodule EMLXAxon.Options do
  @moduledoc false
  # Validation of generation options, shared by EMLXAxon.Qwen3.Generate and
  # EMLXAxon.TextGeneration, so that users get a clear ArgumentError before
  # anything reaches the NIF (where a bad type would only be a badarg).

  @samplers [:greedy, :top_p_cpu, :top_p_gpu]

  @doc false
  def samplers, do: @samplers

  # The generation and sampling options every entry point takes, with the
  # defaults EMLXAxon documents.
  @generation_defaults [
    max_new_tokens: 100,
    max_len: 2048,
    sampler: :greedy,
    temperature: 1.0,
    top_p: 0.9,
    top_k: 0,
    min_p: 0.0,
    seed: nil,
    stop: [],
    eos_token_ids: nil,
    ignore_eos: false
  ]

  @doc false
  def generation_defaults, do: @generation_defaults

  # Constrained decoding: at most one of them, for every input.
  @constraint_keys [:json_schema, :regex, :grammar]

  @doc false
  def constraint_defaults, do: Enum.map(@constraint_keys, &{&1, nil})

  @doc false
  def constraint_keys, do: @constraint_keys

  @doc """
  The constraint `opts` (a map or keyword list with any of `:json_schema`,
  `:regex` and `:grammar`) asks for: `nil` or `{kind, text}`, a JSON
  Schema given as a map encoded to JSON. Raises `ArgumentError` when more
  than one is given or a value has the wrong type; the engine checks the
  schema, regex or grammar itself before generating.
  """
  @spec constraint!(map() | keyword(), String.t()) :: nil | {atom(), String.t()}
  def constraint!(opts, where) do
    given = for key <- @constraint_keys, (value = opts[key]) != nil, do: {key, value}

    case given do
      [] ->
        nil

      [{:json_schema, schema}] when is_map(schema) or is_boolean(schema) ->
        {:json_schema, EMLXAxon.JSON.encode!(schema)}

      [{key, text}] when is_binary(text) ->
        if String.valid?(text) do
          {key, text}
        else
          raise ArgumentError, "expected #{inspect(key)} in #{where} to be valid UTF-8"
        end

      [{:json_schema, other}] ->
        raise ArgumentError,
              "expected :json_schema in #{where} to be a map or a JSON string, " <>
                "got: #{inspect(other)}"

      [{key, other}] ->
        raise ArgumentError,
              "expected #{inspect(key)} in #{where} to be a string, got: #{inspect(other)}"

      [_, _ | _] ->
        raise ArgumentError,
              ":json_schema, :regex and :grammar are mutually exclusive, but #{where} " <>
                "gives #{Enum.map_join(given, " and ", &inspect(elem(&1, 0)))}"
    end
  end

  @doc """
  Validates the keyword list `opts` against `defaults` (a keyword list of
  every accepted option and its default) and returns a map with all of
  them. `where` names the function for error messages.
  """
  @spec validate!(term(), keyword(), String.t()) :: map()
  def validate!(opts, defaults, where) do
    unless Keyword.keyword?(opts) do
      raise ArgumentError,
            "expected #{where} options to be a keyword list, got: #{inspect(opts)}"
    end

    valid = Keyword.keys(defaults)

    opts
    |> Enum.reduce(Map.new(defaults), fn {key, value}, acc ->
      unless Keyword.has_key?(defaults, key) do
        raise ArgumentError,
              "unknown option #{inspect(key)} for #{where}, valid options are: " <>
                Enum.map_join(valid, ", ", &inspect/1)
      end

      Map.put(acc, key, value)
    end)
    |> Map.new(fn {key, value} -> {key, validate_value!(key, value)} end)
  end

  defp validate_value!(:max_new_tokens, value), do: pos_integer!(:max_new_tokens, value)
  defp validate_value!(:max_len, value), do: pos_integer!(:max_len, value)
  defp validate_value!(:chunk_size, nil), do: nil
  defp validate_value!(:chunk_size, value), do: pos_integer!(:chunk_size, value)

  defp validate_value!(:sampler, value) when value in @samplers, do: value

  defp validate_value!(:sampler, value) do
    raise ArgumentError,
          "expected :sampler to be one of #{Enum.map_join(@samplers, ", ", &inspect/1)}, " <>
            "got: #{inspect(value)}"
  end

  # 0 means greedy decoding, as in mlx-lm.
  defp validate_value!(:temperature, value) when is_number(value) and value >= 0, do: value / 1

  defp validate_value!(:temperature, value) do
    raise ArgumentError,
          "expected :temperature to be a number >= 0 (0 decodes greedily), got: #{inspect(value)}"
  end

  defp validate_value!(:top_p, value) when is_number(value) and value > 0 and value <= 1,
    do: value / 1

  defp validate_value!(:top_p, value) do
    raise ArgumentError,
          "expected :top_p to be a number greater than 0 and at most 1, got: #{inspect(value)}"
  end

  defp validate_value!(:top_k, value) when is_integer(value) and value >= 0, do: value

  defp validate_value!(:top_k, value) do
    raise ArgumentError,
          "expected :top_k to be a non-negative integer (0 disables it), got: #{inspect(value)}"
  end

  defp validate_value!(:min_p, value) when is_number(value) and value >= 0 and value < 1,
    do: value / 1

  defp validate_value!(:min_p, value) do
    raise ArgumentError,
          "expected :min_p to be a number from 0 (disabled) up to, but excluding, 1, " <>
            "got: #{inspect(value)}"
  end

  defp validate_value!(:seed, nil), do: nil
  defp validate_value!(:seed, value) when is_integer(value) and value >= 0, do: value

  defp validate_value!(:seed, value) do
    raise ArgumentError,
          "expected :seed to be nil or a non-negative integer, got: #{inspect(value)}"
  end

  defp validate_value!(:stop, nil), do: []
  defp validate_value!(:stop, value) when is_binary(value), do: validate_value!(:stop, [value])

  defp validate_value!(:stop, value) when is_list(value) do
    if Enum.all?(value, &(is_binary(&1) and &1 != "" and String.valid?(&1))) do
      value
    else
      raise ArgumentError,
            "expected :stop to be a non-empty string of valid UTF-8 or a list of them, " <>
              "got: #{inspect(value)}"
    end
  end

  defp validate_value!(:stop, value) do
    raise ArgumentError,
          "expected :stop to be a non-empty string or a list of them, got: #{inspect(value)}"
  end

  defp validate_value!(:eos_token_ids, nil), do: nil

  defp validate_value!(:eos_token_ids, value) when is_integer(value),
    do: validate_value!(:eos_token_ids, [value])

  defp validate_value!(:eos_token_ids, value) when is_list(value) do
    if Enum.all?(value, &(is_integer(&1) and &1 >= 0)) do
      value
    else
      raise ArgumentError,
            "expected :eos_token_ids to be nil or a list of token ids, got: #{inspect(value)}"
    end
  end

  defp validate_value!(:eos_token_ids, value) do
    raise ArgumentError,
          "expected :eos_token_ids to be nil or a list of token ids, got: #{inspect(value)}"
  end

  defp validate_value!(:timeout, value) when value in [nil, :infinity], do: :infinity
  defp validate_value!(:timeout, value) when is_integer(value) and value >= 0, do: value

  defp validate_value!(:timeout, value) do
    raise ArgumentError,
          "expected :timeout to be a non-negative integer (milliseconds) or :infinity, " <>
            "got: #{inspect(value)}"
  end

  defp validate_value!(:enable_thinking, value) when value == nil or is_boolean(value),
    do: value

  defp validate_value!(:enable_thinking, value) do
    raise ArgumentError,
          "expected :enable_thinking to be a boolean or nil, got: #{inspect(value)}"
  end

  defp validate_value!(:tokenizer, nil), do: nil
  defp validate_value!(:tokenizer, %EMLXAxon.Tokenizer{} = tokenizer), do: tokenizer

  defp validate_value!(:tokenizer, value) do
    raise ArgumentError,
          "expected :tokenizer to be an EMLXAxon.Tokenizer (from EMLXAxon.Tokenizer.load/1), " <>
            "got: #{inspect(value)}"
  end

  defp validate_value!(:mlx_stream, nil), do: nil
  defp validate_value!(:mlx_stream, %EMLXAxon.Stream{} = stream), do: stream

  defp validate_value!(:mlx_stream, value) do
    raise ArgumentError,
          "expected :mlx_stream to be an EMLXAxon.Stream, got: #{inspect(value)}"
  end

  defp validate_value!(:defn_options, value) when is_list(value), do: value

  defp validate_value!(:defn_options, value) do
    raise ArgumentError, "expected :defn_options to be a keyword list, got: #{inspect(value)}"
  end

  defp validate_value!(:compile, nil), do: nil

  defp validate_value!(:compile, value) when is_list(value) do
    unless Keyword.keyword?(value) do
      raise ArgumentError, compile_message(value)
    end

    Enum.each(value, fn
      {:batch_size, size} when is_integer(size) and size > 0 ->
        :ok

      {:sequence_length, length} when is_integer(length) and length > 0 ->
        :ok

      {:sequence_length, [_ | _] = lengths} ->
        unless Enum.all?(lengths, &(is_integer(&1) and &1 > 0)) do
          raise ArgumentError, compile_message(value)
        end

      _ ->
        raise ArgumentError, compile_message(value)
    end)

    value
  end

  defp validate_value!(:compile, value), do: raise(ArgumentError, compile_message(value))

  # :stream's meaning depends on the function: it is checked by the caller.
  defp validate_value!(:stream, value), do: value

  defp validate_value!(key, value)
       when key in [
              :ignore_eos,
              :profile_timing,
              :chat,
              :stream_done,
              :add_special_tokens,
              :skip_special_tokens,
              :add_generation_prompt,
              :preallocate_params
            ] do
    if is_boolean(value) do
      value
    else
      raise ArgumentError, "expected #{inspect(key)} to be a boolean, got: #{inspect(value)}"
    end
  end

  # Options specific to one function (validated there).
  defp validate_value!(_key, value), do: value

  defp compile_message(value) do
    "expected :compile to be a keyword list with :batch_size (a positive integer) and/or " <>
      ":sequence_length (a positive integer or a list of them), got: #{inspect(value)}"
  end

  defp pos_integer!(_key, value) when is_integer(value) and value > 0, do: value

  defp pos_integer!(key, value) do
    raise ArgumentError,
          "expected #{inspect(key)} to be a positive integer, got: #{inspect(value)}"
  end

  @doc """
  Checks that `stop` strings come with a tokenizer (the engine matches them
  on decoded text).
  """
  @spec check_stop_needs_tokenizer!(map(), term(), String.t()) :: :ok
  def check_stop_needs_tokenizer!(%{stop: [_ | _]}, nil, where) do
    raise ArgumentError,
          ":stop strings are matched on decoded text, so #{where} needs a tokenizer " <>
            "(the :tokenizer option) to use them"
  end

  def check_stop_needs_tokenizer!(_opts, _tokenizer, _where), do: :ok

  @doc """
  The map of generation options the NIF's `generation_start/5` expects (all
  keys present). `:row_seeds` (one seed or `nil` per prompt, giving each
  row its own random numbers) is taken from `opts` when there, and so is
  `:row_constraints` (one `nil` or `{kind, text}` per prompt).
  """
  @spec native(map()) :: map()
  def native(opts) do
    %{
      max_new_tokens: opts.max_new_tokens,
      max_len: opts.max_len,
      sampler: opts.sampler,
      temperature: opts.temperature,
      top_p: opts.top_p,
      top_k: opts.top_k,
      min_p: opts.min_p,
      seed: opts.seed,
      stop: opts.stop,
      eos_token_ids: opts.eos_token_ids,
      ignore_eos: opts.ignore_eos,
      profile_timing: opts.profile_timing,
      row_seeds: Map.get(opts, :row_seeds)
    }
    |> put_constraints(Map.get(opts, :row_constraints))
  end

  # One `nil` or `{kind, text}` per prompt, or `nil` when no row has one.
  defp put_constraints(native, nil), do: native

  defp put_constraints(native, constraints),
    do: Map.put(native, :row_constraints, constraints)
end
